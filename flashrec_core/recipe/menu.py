"""The synthetic log's catalog: a food-ordering menu, region > cuisine > meal > dish.

Four dishes per (cuisine, meal) cell, meals in the order a day runs (the users' sequential habit
walks that order). Names only; `synthetic.py` turns them into items and interactions.
"""

from __future__ import annotations

MEALS = ("Breakfast", "Lunch", "Dinner", "Dessert")

# region -> cuisine -> one tuple of four dishes per meal, in MEALS order
MENU: dict[str, dict[str, tuple[tuple[str, str, str, str], ...]]] = {
    "Asia": {
        "Japanese": (
            ("Tamagoyaki", "Natto Rice", "Miso Soup Set", "Onigiri"),
            ("Tonkotsu Ramen", "Katsu Curry", "Salmon Bento", "Zaru Soba"),
            ("Sushi Platter", "Chicken Teriyaki", "Beef Sukiyaki", "Tempura Udon"),
            ("Matcha Mochi", "Dorayaki", "Taiyaki", "Matcha Cheesecake"),
        ),
        "Thai": (
            ("Jok Rice Porridge", "Khao Tom", "Thai Omelette Rice", "Patongo Doughnuts"),
            ("Pad Thai", "Khao Man Gai", "Pad Kra Pao", "Som Tam Salad"),
            ("Green Curry", "Massaman Curry", "Tom Yum Goong", "Pad See Ew"),
            ("Mango Sticky Rice", "Coconut Ice Cream", "Thai Tea Pudding", "Khanom Krok"),
        ),
        "Indian": (
            ("Masala Dosa", "Aloo Paratha", "Poha", "Idli Sambar"),
            ("Chole Bhature", "Veg Thali", "Rajma Chawal", "Pav Bhaji"),
            ("Butter Chicken", "Lamb Rogan Josh", "Palak Paneer", "Chicken Biryani"),
            ("Gulab Jamun", "Mango Kulfi", "Rasmalai", "Gajar Halwa"),
        ),
        "Korean": (
            ("Gyeran Bap", "Juk Porridge", "Kimbap Roll", "Gilgeori Toast"),
            ("Bibimbap", "Kimchi Jjigae", "Japchae", "Tteokbokki"),
            ("Bulgogi", "Korean Fried Chicken", "Samgyeopsal", "Galbi Jjim"),
            ("Patbingsu", "Hotteok", "Yakgwa", "Bungeoppang"),
        ),
    },
    "Europe": {
        "Italian": (
            ("Cornetto", "Brioche Col Tuppo", "Frittata", "Ricotta Toast"),
            ("Margherita Pizza", "Panino Caprese", "Penne Arrabbiata", "Minestrone"),
            ("Lasagne", "Risotto ai Funghi", "Osso Buco", "Spaghetti Carbonara"),
            ("Tiramisu", "Panna Cotta", "Cannoli", "Pistachio Gelato"),
        ),
        "French": (
            ("Croissant", "Pain au Chocolat", "Tartine", "Omelette aux Herbes"),
            ("Croque Monsieur", "Quiche Lorraine", "Salade Nicoise", "French Onion Soup"),
            ("Coq au Vin", "Boeuf Bourguignon", "Ratatouille", "Duck Confit"),
            ("Creme Brulee", "Tarte Tatin", "Macarons", "Chocolate Mousse"),
        ),
        "Greek": (
            ("Yogurt with Honey", "Spanakopita", "Bougatsa", "Koulouri"),
            ("Gyros Pita", "Greek Salad", "Souvlaki Wrap", "Fasolada"),
            ("Moussaka", "Pastitsio", "Lamb Kleftiko", "Grilled Octopus"),
            ("Baklava", "Loukoumades", "Galaktoboureko", "Revani"),
        ),
        "Spanish": (
            ("Churros con Chocolate", "Pan con Tomate", "Tortilla Espanola", "Tostada"),
            ("Patatas Bravas", "Bocadillo de Jamon", "Gazpacho", "Croquetas"),
            ("Paella Valenciana", "Gambas al Ajillo", "Pulpo a la Gallega", "Fideua"),
            ("Crema Catalana", "Flan de Huevo", "Tarta de Santiago", "Torrijas"),
        ),
    },
    "Americas": {
        "Mexican": (
            ("Huevos Rancheros", "Chilaquiles", "Breakfast Burrito", "Molletes"),
            ("Tacos al Pastor", "Chicken Quesadilla", "Torta Ahogada", "Pozole"),
            ("Enchiladas Verdes", "Mole Poblano", "Carne Asada", "Chiles Rellenos"),
            ("Tres Leches Cake", "Churros", "Arroz con Leche", "Flan de Cajeta"),
        ),
        "American": (
            ("Pancake Stack", "Eggs Benedict", "Bagel and Lox", "Biscuits and Gravy"),
            ("Cheeseburger", "Club Sandwich", "Mac and Cheese", "Cobb Salad"),
            ("BBQ Ribs", "Fried Chicken Dinner", "Ribeye Steak", "Meatloaf"),
            ("Apple Pie", "New York Cheesecake", "Brownie Sundae", "Pecan Pie"),
        ),
        "Peruvian": (
            ("Pan con Chicharron", "Tamal Peruano", "Quinoa Porridge", "Butifarra Sandwich"),
            ("Ceviche", "Lomo Saltado", "Causa Limena", "Aji de Gallina"),
            ("Pollo a la Brasa", "Anticuchos", "Arroz con Pollo", "Seco de Cordero"),
            ("Suspiro Limeno", "Picarones", "Alfajores", "Mazamorra Morada"),
        ),
        "Brazilian": (
            ("Pao de Queijo", "Tapioca Crepe", "Cuscuz Nordestino", "Acai Bowl"),
            ("Feijoada", "Coxinha Plate", "Moqueca", "Pastel de Feira"),
            ("Picanha", "Bobo de Camarao", "Galinhada", "Escondidinho"),
            ("Brigadeiro", "Quindim", "Pudim", "Beijinho"),
        ),
    },
}
